// expect_error: the action throws kvevict::Error and its message names the problem.
#pragma once

#include <gtest/gtest.h>

#include <kvevict/error.hpp>
#include <string>
#include <string_view>

namespace kvevict::test {

template <class Action>
void expect_error(Action&& action, std::string_view fragment) {
  try {
    action();
    ADD_FAILURE() << "expected kvevict::Error mentioning '" << fragment << "'";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message: " << error.what() << "\nexpected to mention: " << fragment;
  }
}

}  // namespace kvevict::test
